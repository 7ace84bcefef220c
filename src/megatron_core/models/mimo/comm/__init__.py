"""Communication between MIMO modules: the colocated DP bridge (``colocated_communicator``)."""
