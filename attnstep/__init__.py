"""attnstep: find the stage where attention code goes wrong.

The Python API for kernels that live in Python; the command line is `attnstep` (python -m verify).
"""
from verify.api import assert_attention_stages, check_arrays, check_kvcache, flash_attn_criterion, format_report
from verify.check.compare import Report

__all__ = ["check_arrays", "check_kvcache", "assert_attention_stages", "format_report", "flash_attn_criterion", "Report"]
