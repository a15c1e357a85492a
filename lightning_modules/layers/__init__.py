"""Neural-network building blocks shared by several methods."""
