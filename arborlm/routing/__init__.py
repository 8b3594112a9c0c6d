"""Request routing across engine replicas: the policies, and `arborlm router` over HTTP workers."""
