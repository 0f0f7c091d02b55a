"""MySQL (aiomysql): reading Leaf's own ``leaf_alloc`` table, for ``dispenser import-leaf``.

Needs the ``leaf-import`` extra (``pip install 'leaf-dispenser[leaf-import]'``).
"""

__all__ = ["leaf"]
