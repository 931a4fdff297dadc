"""Where a model's bytes come from, behind one interface (base.py, ``ModelSource``): the local
directory catalog (local.py, by the layout rules of layout.py, its models in model.py read
through mapped.py), and origins (origins.py: object storage, an upstream weightserve) filled
into the node cache (node_cache.py) and served by the origin catalog (origin.py)."""
