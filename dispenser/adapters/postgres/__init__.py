"""PostgreSQL (asyncpg): the segment store, its schema, the fleet's request answers and worker IDs."""
