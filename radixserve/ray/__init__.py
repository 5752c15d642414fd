"""radixserve on Ray Serve: replicas placed and scaled by Ray, routed by their radix trees
(app.py; needs the `ray` extra). Nothing here is imported by the rest of the package."""
