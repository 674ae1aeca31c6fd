"""pagedq's producer side: the wire protocol, the sync and asyncio clients, the ``pagedq`` CLI.
Imports only redis and pydantic (and structlog): no torch."""

from .aio import AsyncClient, AsyncJobHandle
from .client import Client, JobHandle
from .core import InvalidJob, JobFailed, JobResult, QueueFull, SampleOutput
from .protocol import PROTOCOL_VERSION, Job, Sampling

__all__ = ["PROTOCOL_VERSION", "AsyncClient", "AsyncJobHandle", "Client", "InvalidJob", "Job",
           "JobFailed", "JobHandle", "JobResult", "QueueFull", "SampleOutput", "Sampling"]
