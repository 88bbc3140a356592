"""Layer discovery: signed layer records stored on the Kademlia-closest peers of each layer key."""
