"""Hugging Face transformers on pagedkv pages (optional: ``pip install 'pagedkv[hf]'``).

`register()` adds an attention implementation named ``"pagedkv"`` to
transformers' `AttentionInterface` (and a mask function that builds no mask:
pagedkv's kernels apply causality from page positions). A model switched to
it runs attention on the paged cache whenever its forward receives a
``pagedkv=ForwardContext(...)`` keyword; `pagedkv.engine.LLMEngine` does this.
"""

from pagedkv.hf.attention import ATTENTION_NAME, ForwardContext, pagedkv_attention, register
from pagedkv.hf.config import kv_params_from_config

__all__ = ["ATTENTION_NAME", "ForwardContext", "kv_params_from_config", "pagedkv_attention", "register"]
