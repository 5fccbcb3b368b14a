"""The client SDK: ServiceClient, TrainingClient, APIFuture and the local (embedded) cluster."""

from .futures import APIFuture
from .local_cluster import LocalCluster
from .service import ServiceClient
from .training import TrainingClient

__all__ = ["APIFuture", "LocalCluster", "ServiceClient", "TrainingClient"]
