"""Generated gRPC stubs for the tandem.v1 protos. Regenerate with `python -m tandem.protos_build`; never edit by hand."""
