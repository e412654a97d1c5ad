"""`pdserve plan`: profile the engine, simulate the fleet, choose a configuration."""
