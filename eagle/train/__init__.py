"""Training maths for draft heads: losses (`eagle.train.losses`) and training-time test (`eagle.train.ttt`)."""
