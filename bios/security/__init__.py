"""Keys, encryption and limits: who may talk to a coordinator, and how much they may ask of it at once."""
