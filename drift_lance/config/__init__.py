"""All configuration models and their defaults, in one package.

One module per area (models, ingest, local, drift, service); this package re-exports the public
ones. Environment variables use the prefix DRIFT_LANCE_.
"""
