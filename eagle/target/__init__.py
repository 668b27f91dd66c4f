"""The frozen target: where it comes from (`resolve`), loading it whole (`loading`) or as FSDP2 shards over
the processes (`shard`), what stages read off it (`structure`), the dtypes it and the head compute in
(`precision`) and the CPU kernel of its small products (`cpu_gemm`)."""
