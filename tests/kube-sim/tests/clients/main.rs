//! Clients we did not write against kube-sim, as one test binary: kube-rs,
//! kubectl 1.20 and 1.33, the Python `kubernetes` client, and a bare HTTP
//! client for the transport and error shapes.

mod common;
mod kube_rs;
mod kubectl_120;
mod kubectl_133;
mod python_client;
mod transport;
