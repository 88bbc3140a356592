"""Imported last by the tests' fork server (``tests.forked.PRELOAD``): what a node does once its imports
are done (``p2pswarm.allocator.imports_without_collections``), done once in the server.

One collection, then every object the imports left alive moved out of the cyclic collector's sight
(``gc.freeze``): a forked node's full collections then walk only its own objects, and never write
the collector's marks into the ~370,000 objects it shares with the server (copying their pages).
"""

import gc

gc.collect()
gc.freeze()
