"""Parity: the harness's methods checked against another implementation's (kvpress 0.5.5, run in its own
virtualenv by tools/parity/), and the golden numbers CI compares with. Validation, not measurement: nothing here
times anything.

Imports core, cli and assets; nothing imports it but its command line and the tests."""
