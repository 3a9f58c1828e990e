"""Part 4 · the same parallel patterns elsewhere in ML (lessons 40-49).

- ``value``: DQN on batched environments, with Episodic Backward Update batched across
  episodes, LS-DQN's batched least-squares head and the t-soft target update (lesson 40).
"""
