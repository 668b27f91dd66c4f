"""The draft-head trainer (`trainer.train`): batches, checkpoints, resume checks, schedule, metrics.
The maths each algorithm trains with (losses, training-time test) lives in `eagle.algorithms`."""
