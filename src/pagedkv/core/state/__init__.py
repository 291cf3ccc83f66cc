"""Recurrent state of hybrid models: checkpoints (`checkpoints.StateCheckpoints`). Pure Python + numpy, like
the rest of `pagedkv.core`."""
