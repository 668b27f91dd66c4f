"""Helpers shared by several test modules (no tests here; pytest does not collect this package).

    data     conversation files and in-memory conversations
    cli      running console scripts in a subprocess: repo root, bin dir, environment
    train    training workspaces, overrides and weight comparisons
    capture  in-process captures and the capture CLI
    decode   random and scripted ("oracle") draft heads, HF greedy references

Asserts in these modules are rewritten by pytest (registered in tests/conftest.py).
"""
