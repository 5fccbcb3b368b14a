"""The client SDK: ServiceClient, TrainingClient, APIFuture and the local (embedded) cluster."""

from .futures import APIFuture
from .local_cluster import LocalCluster
from .rest import RestClient
from .sampling import SamplingClient
from .service import ServiceClient
from .training import TrainingClient

__all__ = ["APIFuture", "LocalCluster", "RestClient", "SamplingClient", "ServiceClient", "TrainingClient"]
