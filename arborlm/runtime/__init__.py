"""The engine: configuration, requests, scheduler, memory pools, model execution, sampling."""
