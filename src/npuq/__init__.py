"""npuq: make Hugging Face decoder LLMs ready for fixed-point NPUs of the Qualcomm HTP class."""

__version__ = "0.3.0"
