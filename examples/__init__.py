"""Example producer factories and trainers: what the docker-compose stack runs."""
