"""The study driver: the stages run for a study (`stages`), multi-seed runs (`runs`), the registered pilot
(`pilot`), a registered positive control (`control`) and the recomputation of a committed study (`recompute`).
The pure logic (registration, results, claims, rules) is tandem/study/."""
