"""DiLoCo between the replicas of a stage: many local inner steps, then one outer step together.

- ``outer``: the outer optimizer (start weights, pseudo-gradient, Nesterov outer step), pure torch;
- ``compression``: pseudo-gradient shards on the wire (fp32, fp16, bf16, int8 with per-chunk scales);
- ``aggregation``: robust combination of the replicas' shards and verification of each contribution;
- ``messages`` and ``round``: the ``/p2pswarm/diloco/1.0.0`` messages and the pure, leaderless
  outer-round state machine (gather, agree on the group, butterfly reduce);
- ``service``: the thin trio driver that runs rounds for a training peer; ``policy`` its pure
  decisions (when to start, tick or catch up a round, whom to believe and to bar, where to load
  from), ``contribution`` what it sends, ``status`` its ``/api/diloco`` document;
- ``loading``: its stage's loads (neighbour, backup, disk), catch-up, snapshots and agreed backups.
"""
