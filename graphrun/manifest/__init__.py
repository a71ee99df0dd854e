"""The output contract: the manifest's models and sections, and the JSON schemas of both contracts."""
