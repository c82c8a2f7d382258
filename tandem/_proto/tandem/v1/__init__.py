"""Generated code; see tandem/_proto/__init__.py."""
