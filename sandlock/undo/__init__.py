"""Review and undo: a run's writes redirected to a scratch copy (dry run) and applied or
discarded afterwards, or its write grants snapshotted (checkpoint) and rolled back.
See docs/undo.md."""
