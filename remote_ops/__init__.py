"""remote-ops: prepare a GPU host over SSH for EAGLE-3 hidden-state extraction with SGLang."""

#: The one place the version is written: pyproject reads it (setuptools dynamic `attr`), and
#: CHANGELOG.md's newest release must equal it (tests/test_release.py).
__version__ = "0.2.0"
