import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
# The default hash seed comes from a seed file (`pagedkv.params.deployment_seed`): the suite (and every child
# process it starts, which inherits the environment) uses one of its own, not the user's.
if "PAGEDKV_HASH_SEED" not in os.environ and "PAGEDKV_HASH_SEED_FILE" not in os.environ:
    os.environ["PAGEDKV_HASH_SEED_FILE"] = os.path.join(tempfile.mkdtemp(prefix="pagedkv-seed-"), "hash_seed")
