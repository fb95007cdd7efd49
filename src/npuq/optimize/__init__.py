"""Accuracy recovery: pure searches (SeqMSE scales, GPTQ rounding) over one layer at a time."""
