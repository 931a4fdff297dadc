"""Node caches filling from each other (issue: a rollout costs the upstream one copy).

A revision leaves the upstream as a private BitTorrent v2 swarm run by libtorrent: the upstream
describes the revision as a torrent (torrents.py), admits the nodes that may read the model and
names them to each other (tracker.py, certs.py), and serves as the swarm's web seed through its
Hub file route; a node cache fills from peers and upstream at once and seeds what it holds
(engine.py). Every file still ends checked against the listing's digest.
"""
