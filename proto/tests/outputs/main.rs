//! Every output made from the protos, checked as one test binary: the
//! checked-in Rust code is fresh (`bootstrap`, which `make proto` runs to
//! regenerate it), the TypeScript package is fresh and builds, and Rust and
//! Python agree on the wire.

mod bootstrap;
mod typescript;
mod wire_python;
