"""Apache ZooKeeper (kazoo): the shared session, Leaf's persistent worker IDs and recyclable leases."""
