"""Test package marker: keeps tests/test_cli.py apart from same-named modules in subfolders."""
