"""Recurrent state of hybrid models: checkpoints (`checkpoints.StateCheckpoints`) and where requests resume
from them (`resume.StateResume`). Pure Python + numpy, like the rest of `pagedkv.core`."""
