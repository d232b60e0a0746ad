"""The trainer step, the training loops, checkpoints, metrics, run directories and downstream tasks."""
