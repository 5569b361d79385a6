"""Router: the OpenAI-compatible HTTP front end, balancing and discovery."""
