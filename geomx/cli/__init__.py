"""Command-line tools: ``geomx launch``, ``geomx bench``."""
