"""qedprobe: look inside QED linear-attention models and intervene on them."""
__version__ = "0.1.0"
