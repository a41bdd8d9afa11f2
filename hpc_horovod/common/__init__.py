"""The engine shared by every binding: topology, settings, negotiation, fusion, execution."""
