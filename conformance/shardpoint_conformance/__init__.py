"""shardpoint conformance suite: round trips across world sizes, fault cases, adapters.

* ``shardpoint conformance run`` (:mod:`.cli`, :mod:`.runner`): seeded cases
  (:mod:`.cases`, :mod:`.strategies`) saved in one layout and loaded in another, in spawned
  gloo worlds, or in the world ``torchrun`` gives; bitwise checks; replay by seed.
* ``shardpoint conformance adapter-test --adapter CMD`` (:mod:`.harness`, protocol in
  :mod:`.adapters`): producer x consumer matrix against another implementation;
  :mod:`.reference_adapter` is ours, :mod:`.broken_adapter` a deliberately broken one.
* :mod:`.faults`: SIGKILLed ranks during a save, damaged chunks and manifests.
"""
