"""The OpenAI API layer shared by the HTTP router and the batch job: request models, validation,
error shapes, text assembly and stop handling."""
