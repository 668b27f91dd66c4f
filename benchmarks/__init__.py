"""Benchmarks that are rerun (decode, capture, train, regenerate, ...) and the one-off studies behind decisions
(`benchmarks.studies`), one way to run them and one record of each run:

    python -m benchmarks                     # lists them
    python -m benchmarks NAME [ARGS ...]     # e.g. python -m benchmarks decode --max-prompts 6

Every run leaves `outputs/benchmarks/NAME/run-YYYYmmdd-HHMMSS.json` (`benchmarks.report`): the command, the machine
(CPU model and the flags that decide bf16 speed), torch, the git commit, the exit code, the seconds and what the
benchmark printed. Figures in docs/ are ratios against a baseline measured in the same run, as each module's
docstring says; the studies' results are in docs/benchmarks.md, each section naming its command.
"""
