"""Running the static graphs: the KV-cache runner and text generation."""
