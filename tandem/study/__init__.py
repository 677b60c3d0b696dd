"""The study package's pure part: typed registrations (`registration`), one result format (`results`), one claims
engine (`claims`), a positive control's rules (`control`) and the pilot's rules (`pilot`); docs/studies.md."""
