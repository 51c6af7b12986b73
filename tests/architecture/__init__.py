"""The architecture checks, read from the source: layers, components, sizes."""
