"""Multi-node jobs: each node a container on a real Docker engine (docs/nodes.md).

The submodules import the Docker SDK (the `nodes` extra); this package imports nothing, so
``import harness`` never pulls in docker.
"""
