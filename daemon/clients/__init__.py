"""Client sessions and what each holds, until its lease ends.

- ``sessions``: the session table, leases, and everything a session owns;
- ``retention``: one session's ``retain_s`` ledger;
- ``pin_releases``: pin tags released, so that a late pin never outlives its release;
- ``lends``: CPU-tier slots a same-user client reads in place;
- ``hints``: wire hints to the tiers' ``RequestHints``, bounded per client.
"""
