"""Task logic per family: load -> preprocess -> run -> postprocess."""
