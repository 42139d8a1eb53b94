"""The layerwise KV pool connector (``kv_connector_module_path`` target).

Importing this package imports vLLM's connector base classes.
"""

from .connector import LayerwisePoolConnector

__all__ = ["LayerwisePoolConnector"]
