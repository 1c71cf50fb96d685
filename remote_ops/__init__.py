"""remote-ops: prepare a GPU host over SSH for EAGLE-3 hidden-state extraction with SGLang."""

__version__ = "0.1.0"
